"""The SAO main job. `python -m sao_jax.main --config=configs/arith_tool.py [--config.x=y]`."""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from sao_jax import configs, host_malloc
from sao_jax.train import loop
from sao_jax.train.resume import ResumeError
from sao_jax.train.validation import ConfigError

config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file "
                                 "(`path.py` or `path.py:variant`).", lock_config=True)
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep JAX/orbax INFO chatter off the console
  if FLAGS.config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/arith_tool.py")
  # before JAX creates its CPU client: XLA:CPU's per-call temp buffers are reused, not re-faulted
  # (SAO_JAX_KEEP_FREED_MEMORY=0 keeps glibc's defaults: memory then shrinks after a peak)
  if os.environ.get("SAO_JAX_KEEP_FREED_MEMORY", "1") != "0":
    host_malloc.keep_freed_memory()
  try:  # loop.run validates (every bad field in one message) and converts the config first
    loop.run(FLAGS.config)
  except (ConfigError, ResumeError) as e:
    raise SystemExit(f"{e}") from None  # exit status 1, the message on stderr, no traceback


if __name__ == "__main__":
  app.run(main, flags_parser=configs.parse_flags)
