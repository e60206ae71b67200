"""Drafter networks that read a target's states or tokens: MTP, EAGLE-3, DFlash, the Gemma 4
assistant, and a draft vocabulary cut (the speculation room drives them)."""
