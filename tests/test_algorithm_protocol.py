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
  # What run reads of the built algorithm: its rollout's log line, then its preflight, whose
  # result (RLOO's: 'auto' budgets resolved) is what the loop runs.
  ready = types.SimpleNamespace(name="ready")
  algo = types.SimpleNamespace(exp=types.SimpleNamespace(rollout_shape=types.SimpleNamespace(
      line="[rollout] the static sampler")), preflight=step("preflight", ready))
  monkeypatch.setattr(algorithms, "build", step("build", algo))
  ran = []
  monkeypatch.setattr(algorithms.loop, "run", lambda a, *args, **kw: (
      steps.append("loop"), ran.append(a), {"done": True})[-1])
  logged = []
  assert algorithms.run({"algorithm": "rloo"}, str(tmp_path), log=logged.append) == {"done": True}
  assert steps == ["validate", "check_config", "build", "preflight", "loop"]
  assert ran == [ready]
  assert "[rollout] the static sampler" in logged


def test_the_preflight_plans_rloo_and_says_the_others_go_unchecked(monkeypatch):
  """RLOO's preflight resolves microbatch_tokens='auto' and checks the plan (the RLHF pipeline's
  RL stage as `algorithms.run`); PPO and DPO on an accelerator say the plan does not cover them,
  and on CPU nothing is said."""
  from rloo_jax.algorithms import rloo as rloo_lib
  calls, logged = [], []
  resolved = object()
  monkeypatch.setattr(rloo_lib.budget, "resolve",
                      lambda a, log: (calls.append(("resolve", a)), (resolved, {"r": 1}))[-1])
  monkeypatch.setattr(rloo_lib.memory, "check",
                      lambda a, log, report: calls.append(("check", a, report)))
  algo = object.__new__(rloo_lib.RLOO)
  assert algo.preflight(log=logged.append) is resolved
  assert calls == [("resolve", algo), ("check", resolved, {"r": 1})]

  from rloo_jax import config_utils
  for platform, said in (("gpu", True), ("cpu", False)):
    other = object.__new__(ALGORITHMS["ppo"])
    other.exp = types.SimpleNamespace(config=config_utils.base_config(),
                                      layout=types.SimpleNamespace(platform=platform))
    logged.clear()
    assert other.preflight(log=logged.append) is other
    assert logged == ([f"[plan] config.train.check_memory: the memory plan covers the RLOO "
                       f"programs only; ppo is not checked"] if said else [])


def test_the_build_trusts_the_validated_config():
  """experiment.build and build_abstract run no check of their own: validation is once."""
  from rloo_jax import experiment
  build = inspect.getsource(experiment.build) + inspect.getsource(experiment.build_abstract)
  assert "validate_config" not in build and "validate_layout" not in build
