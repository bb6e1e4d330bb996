"""MAPS (Elhelo & Geva 2024): relation scores from the weights, inference-time checks, the whole study."""
