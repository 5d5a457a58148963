"""Every algorithm implements the protocol the outer loop drives, and the loop reads its
algorithm only through it (no hasattr / getattr probing)."""
import ast
import inspect
import types

from rloo_jax import loop
from rloo_jax.algorithms import ALGORITHMS, base


def protocol_members() -> set[str]:
  members = set(base.Algorithm.__annotations__)
  members |= {name for name, value in vars(base.Algorithm).items()
              if not name.startswith("_") and (callable(value) or isinstance(value, property))}
  return members


def test_every_algorithm_has_every_member_of_the_protocol():
  members = protocol_members()
  assert {"iteration", "batches", "resume_state", "eval_params", "summary_extra"} <= members
  for name, cls in ALGORITHMS.items():
    assert cls.name == name and cls.label
    assert issubclass(cls, base.AlgorithmBase)
    missing = sorted(m for m in members - {"exp"} if not hasattr(cls, m))
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_the_loop_probes_no_attribute():
  calls = [node.func.id for node in ast.walk(ast.parse(inspect.getsource(loop)))
           if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
  assert "hasattr" not in calls and "getattr" not in calls


def test_a_run_is_validate_then_build_then_the_memory_preflight_then_the_loop(tmp_path,
                                                                                monkeypatch):
  from rloo_jax import algorithms, workdir as workdir_lib
  steps = []

  def step(name, result=None):
    def record(*args, **kwargs):
      del args, kwargs
      steps.append(name)
      return result
    return record

  from rloo_jax import config_utils, sharding
  config = config_utils.base_config()
  checked = algorithms.Checked("rloo", config, sharding.make_layout(config.mesh), None)
  monkeypatch.setattr(algorithms, "validate", step("validate", checked))
  monkeypatch.setattr(workdir_lib, "check_config", step("check_config"))
  # What run reads of the built algorithm before the preflight: its rollout's log line.
  algo = types.SimpleNamespace(exp=types.SimpleNamespace(rollout_shape=types.SimpleNamespace(
      line="[rollout] the static sampler")))
  monkeypatch.setattr(algorithms, "build", step("build", algo))
  monkeypatch.setattr(algorithms.memory, "check", step("preflight"))
  monkeypatch.setattr(algorithms.loop, "run", step("loop", {"done": True}))
  logged = []
  assert algorithms.run({"algorithm": "rloo"}, str(tmp_path), log=logged.append) == {"done": True}
  assert steps == ["validate", "check_config", "build", "preflight", "loop"]
  assert "[rollout] the static sampler" in logged


def test_the_build_trusts_the_validated_config():
  """experiment.build and build_abstract run no check of their own: validation is once."""
  from rloo_jax import experiment
  build = inspect.getsource(experiment.build) + inspect.getsource(experiment.build_abstract)
  assert "validate_config" not in build and "validate_layout" not in build
