"""The commands: what ``ckpt inspect|convert|export|reshard|shard|verify|estimate``
do, as plain functions (a long one in two modules: verify + compare, shard + shard_job,
convert + export + options). They may import every layer below; nothing below imports them."""
