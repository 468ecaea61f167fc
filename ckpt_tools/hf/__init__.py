"""Hugging Face around the weights: the hub, the assets beside an export (config, tokenizer),
the model class a config names and the architecture check that asks ``from_pretrained``."""
