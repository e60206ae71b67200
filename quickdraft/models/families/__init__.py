"""Model families: one file each on the shared skeleton (models/layers.py, models/base.py),
holding only what is the family's own, and the vision towers."""
