"""Naming schemes at the edge of export: one module each says how to recognise its names and
how they map to the Hugging Face names an architecture loads (PEFT LoRA, torchtitan).
The core (describe, plan, engine) never learns these names."""
