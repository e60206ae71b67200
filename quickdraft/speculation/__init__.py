"""Speculative decoding: drafters propose, `verify` keeps the longest correct prefix plus one
target token, the policy decides how many tokens to draft from what they cost. See
docs/architecture.md; nothing is re-exported here so that importing one part (the cost tables,
the sampler) never loads the others."""
