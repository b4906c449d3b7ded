"""Pipeline parallelism's bookkeeping (layers/pipeline.py): which layers a stage holds, microbatches that keep a
device's rows, the bubble, and the config errors, one line each naming the keys. The pipelined step equal to one
stage (loss and every gradient) is tests/integration/test_pipeline_parallel.py."""

import numpy as np
import pytest

from MaxText.config import pyconfig
from MaxText.config.types import ConfigError
from MaxText.layers import pipeline
from tests.conftest import make_config


def test_a_stage_holds_layers_in_circular_order_and_the_layer_order_comes_back():
  s, r, n = 2, 3, 2  # l = (r*S + s)*n + j
  staged = np.asarray(pipeline.by_stage(np.arange(s * r * n), s, r))  # [S,R*n]
  assert staged.tolist() == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
  back = pipeline.layer_order(staged.reshape(s, r, n))  # [S,R,n] -> [L]
  np.testing.assert_array_equal(back, np.arange(s * r * n))
  gpipe = np.asarray(pipeline.by_stage(np.arange(8), 4, 1))  # R = 1: contiguous blocks, as "layers" -> stage shards
  assert gpipe.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_microbatches_take_every_mth_row_and_come_back_in_order():
  x = np.arange(12 * 3).reshape(12, 3)
  micro = np.asarray(pipeline.to_microbatches(x, 4))  # [4,3,3]
  np.testing.assert_array_equal(micro[1], x[[1, 5, 9]])  # a device's contiguous rows stay in every microbatch
  np.testing.assert_array_equal(pipeline.from_microbatches(micro), x)


@pytest.mark.parametrize("keys,bubble", [
    (dict(ici_pipeline_parallelism=4), 3 / 7),  # GPipe, M = S: (S-1)/(M+S-1)
    (dict(ici_pipeline_parallelism=4, num_pipeline_microbatches=16), 3 / 19),
    (dict(ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=1), 1 / 9)])  # circular R = 4: (S-1)/(RM+S-1)
def test_the_bubble_is_the_idle_share_of_a_stages_iterations(keys, bubble):
  cfg = make_config(num_devices=keys["ici_pipeline_parallelism"], num_decoder_layers=9, global_batch_size=16, **keys)
  assert pipeline.bubble_fraction(cfg) == pytest.approx(bubble)


@pytest.mark.parametrize("keys,said", [
    (dict(ici_pipeline_parallelism=4, num_decoder_layers=7), "do not divide the 6 MoE layers"),
    (dict(ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=3), "do not divide the 4 MoE layers"),
    (dict(ici_pipeline_parallelism=4, num_pipeline_microbatches=2), "num_pipeline_microbatches=2 is fewer than the 4"),
    (dict(ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=1, num_pipeline_microbatches=4),
     "circular repeats, which take num_pipeline_microbatches = the 2 stages"),
    (dict(ici_pipeline_parallelism=2, scan_layers=False), "need scan_layers=true"),
    (dict(ici_pipeline_parallelism=2, num_pipeline_microbatches=4, global_batch_size=10),
     "10 rows do not split into num_pipeline_microbatches=4"),
    (dict(ici_pipeline_parallelism=2, ici_data_parallelism=4, num_pipeline_microbatches=4, num_devices=8),
     "3 rows per pipeline microbatch, not divisible by the 4 batch shards"),
    (dict(ici_pipeline_parallelism=2, mesh_axes=["data", "fsdp", "context", "tensor", "expert"], num_devices=1),
     "need the mesh axis stage in mesh_axes")])
def test_a_pipeline_the_model_or_batch_cannot_take_is_one_line_naming_the_keys(keys, said):
  keys = {"num_decoder_layers": 5, "global_batch_size": 12, **keys}
  keys.setdefault("num_devices", keys["ici_pipeline_parallelism"])
  with pytest.raises(ConfigError) as e:
    make_config(**keys)
  assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_stage_axis_is_ici_times_dcn_and_sized_into_the_mesh():
  cfg = pyconfig.initialize(["t", "base.yml"], num_devices=8, ici_pipeline_parallelism=2, dcn_pipeline_parallelism=2,
                            num_decoder_layers=5, global_batch_size=16)
  assert cfg.mesh_shape == {"stage": 4, "data": 2, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1}
  assert (cfg.pipeline_stages, cfg.layers_per_pipeline_stage, cfg.pipeline_repeats, cfg.pipeline_microbatches) == \
      (4, 1, 1, 4)
