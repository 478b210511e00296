"""Speculative decoding (seed steps 45-48): proposers that draft tokens, and the rejection
sampler that keeps the longest prefix the target model agrees with."""
