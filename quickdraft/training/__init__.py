"""Drafters trained by quickdraft itself, against a frozen target (`quickdraft train-drafter`).

Offline, outside serving: corpus.py runs a text corpus through the target once (tapped hidden
states + the target's own greedy next tokens), dflash.py trains a DFlash block drafter on them
and writes the public checkpoint layout that speculation/drafters/dflash.py loads.
"""
