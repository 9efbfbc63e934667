"""Draft heads: multi-token-prediction (MTP) modules attached to a target model.

`mtp` defines the module and its on-disk form; `layouts` reads the MTP layers that ship inside
checkpoints (DeepSeek-V3/GLM-4.5, Qwen3-Next, MiMo); `train` self-distils a head for a model that
has none. Nothing here imports the engine: the engine runs a head over its paged KV pool.
"""
