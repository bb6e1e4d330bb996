"""Tiny random-weight vision-language models for tests (no download).

`make_tiny_vlm(kind)` builds a LLaVA, Qwen2-VL or Idefics3 (SmolVLM-style) model
from configs in code: a one-layer vision tower on 16x16 or 32x32 images, a 2-layer
text model with GQA, random weights, the embedded SmolLM2 tokenizer (ChatML
template) with the family's image tokens added, and an offline processor built
from the Pillow image processor + that tokenizer. `save_tiny_vlm` writes it as a
Hugging Face folder for `heads.load_model(folder)`.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from heads import HeadModel, load_tokenizer
from heads.model.loading import image_text_processor, vlm_head_model

KINDS = ("llava", "qwen2_vl", "idefics3")

# Image tokens per image for the sizes below (asserted by the tests against the processor).
IMAGE_TOKENS = {"llava": 16, "qwen2_vl": 4, "idefics3": 4}


def image(seed: int = 0, size: int = 16) -> Image.Image:
    """A random RGB image of `size` x `size` pixels."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _text_kwargs(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def _tokenizer(extra: list[str]):
    tok = load_tokenizer()  # a fresh copy: the session fixture must stay unchanged
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _llava(seed: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = _tokenizer(["<image>"])
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
        projection_dim=32,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**_text_kwargs(len(tok))),
        image_token_id=image_id,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=IMAGE_TOKENS["llava"],
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    improc = CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, do_center_crop=True
    )
    return model, image_text_processor(improc, tok, cfg)


def _qwen2_vl(seed: int):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")}
    text = _text_kwargs(len(tok)) | dict(
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    improc = Qwen2VLImageProcessorPil(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 16 * 16, "longest_edge": 16 * 16},
    )
    return model, image_text_processor(improc, tok, cfg)


def _idefics3(seed: int):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    cfg = Idefics3Config(
        vision_config=Idefics3VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
        ),
        text_config=LlamaConfig(**_text_kwargs(len(tok))),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    improc = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": 16},
        max_image_size={"longest_edge": 16},
        do_resize=True,
    )
    return model, image_text_processor(improc, tok, cfg)


_BUILDERS = {"llava": _llava, "qwen2_vl": _qwen2_vl, "idefics3": _idefics3}


def make_tiny_vlm(kind: str, seed: int = 0, attn: str = "sdpa") -> HeadModel:
    """A tiny random VLM of `kind` (`llava`, `qwen2_vl`, `idefics3`) as a `HeadModel` with `processor`."""
    model, proc = _BUILDERS[kind](seed)
    model.set_attn_implementation({"text_config": attn})
    model = model.float().eval()
    return vlm_head_model(model, proc, name=f"tiny-{kind}")


def save_tiny_vlm(hm: HeadModel, folder) -> str:
    """Save `hm`'s model and processor as a Hugging Face folder; returns its path."""
    hm.model.save_pretrained(folder)
    hm.processor.save_pretrained(folder)
    return str(folder)
