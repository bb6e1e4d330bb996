"""CARVE: contrastive attention refinement for visual enhancement (the image refined by the contrast of
task and general attention)."""

from steer.carve.method import Carve, CarveMaps, contrast_map, pixel_mask, refine_image

__all__ = ["Carve", "CarveMaps", "contrast_map", "pixel_mask", "refine_image"]
