"""The models room: the packed-forward protocol and the shared decoder skeleton (base.py,
layers.py), the `model_type` registry, the GPU graph wrapper, and four sub-rooms: families/
(one file per model family and vision tower), heads/ (drafter networks: MTP, EAGLE-3, DFlash,
the Gemma 4 assistant, a draft vocabulary), formats/ (checkpoint, GGUF and mmproj loaders, the
packed copy) and caches/ (KV, slot and hybrid state caches)."""
