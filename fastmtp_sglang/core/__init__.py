"""The contract every other part builds on: the head, draft directories, checkpoints, identity,
errors, target loading and prompt files.

Owns: ``head`` (FastMTPHead, pure torch), ``draft_dir`` (the on-disk contract, strict load,
atomic write), ``checkpoint`` (reading base checkpoints), ``convert`` (layouts and native MTP
layers into draft directories), ``target`` (loading and fit checks), ``identity`` (config and
tokenizer hashes), ``prompts`` (prompt files and the chat template), ``demo_target`` (the embedded
SmolLM2 target), ``errors``.

May import: nothing of this package outside ``core`` (third-party libraries only).
"""
