"""Safety heads: Ships, dataset-level Ships, Sahara (Zhou et al. 2025) and the attribution estimate."""
