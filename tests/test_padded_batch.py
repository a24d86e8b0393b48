"""An export whose sample is a left-padded batch (a row of ``attention_mask`` starts with 0s): the
padded positions' attention rows have every key masked, eager PyTorch gives 0 there and
onnxruntime does not. The ParityError says so and how to export; the recipe it gives (a mask of
ones as the sample) makes a file that computes the padded batch as PyTorch does where the mask
keeps."""

from __future__ import annotations

import models
import numpy as np
import pytest
import torch

from onnx_modular import export_modular
from onnx_modular.errors import ParityError
from onnx_modular.runtime import sessions as runtime


@pytest.fixture(scope="module")
def llama():
    model, (ids,), _ = models.llama()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding of the first sequence
    return model, ids, mask


def test_padded_sample_error_says_what_and_how(llama, tmp_path):
    model, ids, mask = llama
    path = tmp_path / "padded.onnx"
    with pytest.raises(ParityError) as caught:
        export_modular(model, (), path, kwargs={"input_ids": ids, "attention_mask": mask})
    text = str(caught.value)
    assert "differ only at the 3 positions attention_mask pads (in 1 of 2 sequences)" in text
    assert "every key masked" in text and "attention_mask=torch.ones_like(attention_mask)" in text
    assert caught.value.report.padding and caught.value.report.to_dict()["padding"] == caught.value.report.padding
    assert not path.exists()


def test_the_recipe_exports_a_file_that_takes_the_padded_batch(llama, tmp_path):
    model, ids, mask = llama
    path = tmp_path / "ones.onnx"
    export_modular(model, (), path, kwargs={"input_ids": ids, "attention_mask": torch.ones_like(mask)})
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    (actual,) = runtime.run(str(path), {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}, what="test")[1]
    keep = mask.numpy().astype(bool)
    np.testing.assert_allclose(actual[keep], expected[keep], atol=1e-4, rtol=1e-3)
    assert np.abs(actual[~keep] - expected[~keep]).max() > 1e-2  # padded positions: meaningless, and they differ
