"""The commands, one module each: what ``ckpt inspect|convert|export|reshard|shard|verify|estimate``
do, as plain functions. They may import every layer below; nothing below imports them."""
