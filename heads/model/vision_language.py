"""Loading vision-language models (LLaVA, Qwen2-VL, Idefics3 / SmolVLM) with their processor:
`AutoModelForImageTextToText`, and the processor rebuilt from the folder's image processor and
tokenizer where `AutoProcessor` cannot build it."""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING, cast

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.model.checks import check_weights_values

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedConfig, ProcessorMixin

__all__ = ["image_text_processor", "load_processor", "vlm_head_model"]


def _is_vision_language_folder(where: str) -> bool:
    """True when the model folder (or hub id) holds a vision-language config."""
    from transformers import AutoConfig

    from heads.inputs.images import is_vision_language

    return is_vision_language(AutoConfig.from_pretrained(where, trust_remote_code=False))


@cache
def _qwen2_vl_image_only_class() -> type[ProcessorMixin]:
    """Qwen2-VL's processor without its video processor (which needs torchvision)."""
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
        """`Qwen2VLProcessor` for images and text only: no video processor."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Qwen2VLImageProcessorOnly


def image_text_processor(
    image_processor: object, tokenizer: object, config: PreTrainedConfig
) -> ProcessorMixin:
    """Build a vision-language model's processor from its image processor and tokenizer.

    Used when `AutoProcessor` cannot load one (e.g. Qwen2-VL's processor needs a
    video processor, and video processing needs torchvision) and by tests.
    Supported: `llava`, `qwen2_vl`, `qwen2_5_vl`, `idefics3`, `smolvlm`; the
    image-token count per image is derived from the config.

    Raises:
        ValueError: another model type.
    """
    kind = getattr(config, "model_type", "")
    if kind == "llava":
        from transformers.models.llava.processing_llava import LlavaProcessor

        vision = config.vision_config
        cls_token = 1 if getattr(vision, "model_type", "") == "clip_vision_model" else 0
        return LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=vision.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            num_additional_image_tokens=cls_token,
        )
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen2_vl_image_only_class()(image_processor=image_processor, tokenizer=tokenizer)
    if kind in ("idefics3", "smolvlm"):
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

        vision = config.vision_config
        seq_len = int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor**2)
        return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len)
    raise HeadsteerValueError(
        f"no processor recipe for model_type={short_repr(kind)}; save the model's processor in its folder"
    )


def load_processor(where: str | os.PathLike, config: PreTrainedConfig | None = None) -> ProcessorMixin:
    """The processor of a vision-language model folder.

    `AutoProcessor.from_pretrained` first; if that fails (a processor that needs
    torchvision, or none saved), the family's processor is rebuilt from the
    folder's image processor and tokenizer (`image_text_processor`).

    Raises:
        ValueError: no processor can be built (naming the reason).
    """
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        proc: ProcessorMixin = AutoProcessor.from_pretrained(where, trust_remote_code=False)
        if getattr(proc, "image_processor", None) is None or getattr(proc, "tokenizer", None) is None:
            # AutoProcessor falls back to a bare tokenizer when the processor class cannot be built
            raise HeadsteerValueError(
                f"AutoProcessor gave a {type(proc).__name__}, not an image + text processor"
            )
        return proc
    except Exception as first:  # noqa: BLE001 (transformers raises many kinds here)
        try:
            config = (
                config if config is not None else AutoConfig.from_pretrained(where, trust_remote_code=False)
            )
            improc = AutoImageProcessor.from_pretrained(where, trust_remote_code=False)
            tok = AutoTokenizer.from_pretrained(where, trust_remote_code=False)
            return image_text_processor(improc, tok, config)
        except Exception as second:  # noqa: BLE001
            raise HeadsteerValueError(
                f"cannot load the processor of {str(where)!r}: {first}; rebuilding it failed too: {second}"
            ) from second


def vlm_head_model(model: torch.nn.Module, processor: ProcessorMixin, name: str | None = None) -> HeadModel:
    """A `HeadModel` over a vision-language model's language model, with `processor` attached.

    The tokenizer is `processor.tokenizer`; a tokenizer without a pad token pads with EOS.
    """
    tok = processor.tokenizer
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return HeadModel(model.eval(), tok, name=name, processor=processor)


def _load_vision_language(
    where: str, name: str, dtype: torch.dtype, device: str | torch.device, attn_implementation: str
) -> HeadModel:
    """Load a vision-language folder with `AutoModelForImageTextToText`.

    `attn_implementation` is set on the language model only (`text_config`).
    """
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        where,
        dtype=dtype,
        attn_implementation={"text_config": attn_implementation},
        use_safetensors=True,
        trust_remote_code=False,
    )
    check_weights_values(where, model)
    cast(torch.nn.Module, model).to(device)  # nn.Module.to's signature (transformers' @wraps hides it)
    return vlm_head_model(model, load_processor(where, model.config), name=name)
