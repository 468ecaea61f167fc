"""Where bytes land: the staged commit (never a half-written destination), disk writes as ``cp``
does them, casts streamed block by block, and the manifest."""
