"""The contract every other part builds on: the head, draft directories, checkpoints and their
formats, identity, errors, target loading, prompt files and what the CPU has.

Owns: ``head`` (FastMTPHead, pure torch), ``attention`` (grouped key/value heads folded into
query rows for PyTorch's attention), ``draft_dir`` (the on-disk contract, strict load, atomic
write), ``checkpoint`` (reading base checkpoints), ``layouts`` (an MTP layer's tensor names per
checkpoint family, and the exact changes between them), ``convert`` (layouts and native MTP
layers into draft directories), ``export_native`` (the head as the target's own MTP layer),
``speculators_format`` (vLLM's speculators format <-> draft directories), ``target`` (loading and
fit checks), ``identity`` (config and tokenizer hashes), ``prompts`` (prompt files and the chat
template), ``demo_target`` (the embedded SmolLM2 target), ``errors``, ``hardware`` (what the CPU
can do fast, ``--dtype auto``).

May import: nothing of this package outside ``core`` (third-party libraries only).
"""
