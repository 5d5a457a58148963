"""rloo_jax: critic-free online RLHF with RLOO in JAX."""
from setuptools import find_packages, setup

setup(
    name="rloo_jax",
    version="0.1.0",
    description="REINFORCE Leave-One-Out (RLOO) for RLHF in JAX / Flax NNX",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # as flax 0.12's
    packages=find_packages(include=["rloo_jax", "rloo_jax.*"]),
    # Each lower bound here and in [test] / [hf] is what `uv pip install --resolution lowest-direct`
    # takes, and the tests pass there (README): pip keeps an installed version that meets it.
    install_requires=[
        # The jax every check here passes on, on every Python; older ones fail its tests. Python
        # 3.12 and 3.13 would otherwise get jax 0.12.1, whose suite passes (Python 3.12) but whose
        # GPU build is CUDA 13 only (no jax-cuda12-plugin 0.12.1) and whose jax[tpu] needs a
        # libtpu (0.0.53) PyPI does not hold: [plan] and the notebooks' accelerator installs
        # cannot follow it yet.
        "jax>=0.10.2,<0.11",
        "flax>=0.12.8",
        # optax.init_empty_state came in 0.2.6; 0.2.7 sets a jax option jax 0.10 lacks;
        # orbax-checkpoint before 0.11.17 imports a jax.experimental.layout name jax 0.10 removed.
        "optax>=0.2.6,!=0.2.7",
        "orbax-checkpoint>=0.11.17",
        "chex>=0.1.90",
        # 1.0.0 compiles with a SyntaxWarning on Python 3.12+: a line before a run's one-line error.
        "ml_collections>=1.1.0",
        # Datasets are tfds builders stored as array_record and read with tfds.data_source / grain:
        # no TensorFlow anywhere.
        # 4.9.9 and older read dataset features through a protobuf field protobuf 7 removed.
        "tensorflow-datasets>=4.9.10",
        # Its tensorflow-metadata 1.21 is protobuf 6.31 gencode but asks only for protobuf>=4.25;
        # under protobuf 5 (wandb before 0.19.10 holds it below 6) tfds does not import.
        "protobuf>=6.31.1",
        "array_record>=0.7.1",
        "grain>=0.2.10",
        "numpy>=2.0",  # as jax 0.10's
        # bfloat16 / float8 numpy types (safetensors read and written by rloo_jax.models, and
        # jax's). 0.7.0's cast registration doubles the time `import jax` takes, paid by every
        # command and subprocess; 0.6.0 has every dtype jax and these modules use.
        "ml_dtypes>=0.5,!=0.7.0",
        "absl-py>=2.1",
        "tokenizers>=0.20",
        # config.data.chat_template: instruct models' Jinja chat templates (rloo_jax.data.chat).
        "jinja2>=3.1",
        "safetensors>=0.4",
        # config.model.init_from / load_policy given a hub id 'org/name' (snapshot_download).
        "huggingface_hub>=0.23",
        "tensorboardX>=2.6.1",
        "tqdm>=4.66",
        # 3.8 fails under IPython 9 (notebooks' inline plots).
        "matplotlib>=3.9",
    ],
    extras_require={
        # wandb: the optional Weights & Biases writer is tested offline (WANDB_MODE=offline).
        # pytest-xdist 3.8: pytest.ini's --no-loadscope-reorder.
        "test": ["pytest>=8", "pytest-xdist>=3.8", "nbclient>=0.10", "nbformat>=5.10",
                 "ipykernel>=6.29", "wandb>=0.19.10", "math-verify>=0.7.0"],
        # The viewer of the event files every run writes: tensorboard --logdir <workdir>/tensorboard
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb>=0.19.10"],
        # rloo_jax.rewards.math_answer (configs/math.py). Before 0.7 several boxed answers
        # counted as right when one was: boxing every candidate would be rewarded.
        "math": ["math-verify>=0.7.0"],
        # Live parity checks against transformers and PEFT, and the TRL / HF-generate benchmarks.
        # torch 2.13.0 is pinned so pip takes the CPU wheel rather than a multi-GB CUDA build.
        # transformers 4.57 fails the parity tests on padded rows (llama3, gemma3, PEFT adapters).
        "hf": ["torch==2.13.0", "transformers>=5.0", "peft>=0.13"],
        # The TPU and GPU compilers, run deviceless by `python -m rloo_jax.plan --target=...`
        # (libtpu; the CUDA plugin compiles with no GPU, and with cuDNN's libraries, which
        # attention='cudnn' compiles against, what 'auto' picks on a GPU). Pinned to jax's version.
        "plan": ["jax[tpu]==0.10.2", "jax-cuda12-plugin==0.10.2", "jax-cuda12-pjrt==0.10.2",
                 "nvidia-cudnn-cu12>=9.8,<10"],
    },
)
