"""Byte formats below the checkpoint formats: torch's pickle trees (what their nodes mean, how
they are emitted), the ``torch.save`` zip written without torch, DCP's ``.metadata`` pickle."""
