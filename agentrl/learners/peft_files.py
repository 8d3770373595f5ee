"""The file names of a PEFT adapter directory (peft's own names), in a module of their own so that checkpoints
(`agentrl.learners.checkpoint`), LoRA (`agentrl.learners.lora`) and the Megatron checkpoint share them without
importing each other."""

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
