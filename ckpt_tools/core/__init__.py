"""What every layer shares: the description of a checkpoint, plans (pure data), element types and
non-tensor training state. Imports nothing of ckpt_tools but ``errors``."""
