"""A vision-language checkpoint's preprocessor_config.json decides how its images are cut and
normalized (pixel limits, patch sizes, rescale, mean and std), on the router (how many image
tokens) and on the prefill side (the pixels): Baton's pixels equal those of transformers' own
image processor built from the same file."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from vl_helpers import png, tiny_vl_config

from baton.models.layers.vision import preprocess_image
from baton.models.multimodal import QWEN3_VL_MAX_PIXELS, ImageInput, ImagePlaceholders
from baton.models.source import resolve_model

# CLIP's normalization and a smaller pixel budget than Qwen3-VL's: nothing here is the default
PROCESSOR = {"size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 64 * 64 * 4}, "patch_size": 16, "merge_size": 2,
             "temporal_patch_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "rescale_factor": 0.00392156862745098,
             "image_processor_type": "Qwen2VLImageProcessor"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vl")
    tiny_vl_config().save_pretrained(folder)            # the config is all resolve_model reads
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return folder


def test_the_checkpoints_processor_config_sets_the_image_rules(checkpoint):
    placeholders = ImagePlaceholders.from_config(resolve_model(str(checkpoint)).hf_config)
    assert (placeholders.min_pixels, placeholders.max_pixels) == (32 * 32 * 4, 64 * 64 * 4)
    assert placeholders.image_mean == tuple(PROCESSOR["image_mean"])
    assert placeholders.image_std == tuple(PROCESSOR["image_std"])
    big = ImageInput(png(640, 480, seed=1))
    t, h, w = placeholders.grid_thw(big)
    assert h * w * 16 * 16 <= 64 * 64 * 4 and t == 1            # the file's budget, not Qwen3-VL's 16.7M pixels


def test_without_a_processor_config_the_rules_are_qwen3_vls():
    placeholders = ImagePlaceholders.from_config(tiny_vl_config())
    assert placeholders.max_pixels == QWEN3_VL_MAX_PIXELS and placeholders.image_mean == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("size", [(200, 120), (640, 480)])
def test_the_pixels_are_transformers_image_processors_from_the_same_file(checkpoint, size):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    placeholders = ImagePlaceholders.from_config(resolve_model(str(checkpoint)).hf_config)
    image = ImageInput(png(*size, seed=2))
    pixels, grid = preprocess_image(image, placeholders)
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    out = Qwen2VLImageProcessorPil(**settings)(images=[Image.open(io.BytesIO(image.data))], return_tensors="np")
    assert tuple(out["image_grid_thw"][0]) == grid
    np.testing.assert_allclose(pixels, out["pixel_values"], atol=1e-5)
