"""megamoe as a vLLM plugin: installed with the package (`pip install megamoe[vllm]`), vLLM's MoE
layers run on megamoe with no change to vLLM or to the model (docs/VLLM.md).

vLLM finds `register` through the `vllm.general_plugins` entry point and calls it in every process it
starts (front end, engine core, workers), possibly more than once. It puts megamoe's MoE methods in
place of three of vLLM's: unquantized (BF16) MoE, ModelOpt NVFP4 MoE and compressed-tensors NVFP4 MoE.
Each layer then decides for itself whether megamoe serves it (megamoe.vllm._methods) and says so in
the log, once per layer kind and decision.

Settings (environment variables, read when register runs):
  MEGAMOE_VLLM=0              turn the plugin off (vLLM's own VLLM_PLUGINS allow-list does too)
  MEGAMOE_VLLM_ACTIVATIONS    an NVFP4 layer's activations, SPEC §3b: bf16 (default, W4A16) or nvfp4
  MEGAMOE_VLLM_CPU_BF16=1     serve unquantized layers on the CPU too (megamoe's CPU backend is the
                              reference, not a fast path, so vLLM's own CPU kernel keeps them by default)
"""
import logging
import os
import threading

_ENV_SWITCH = "MEGAMOE_VLLM"
_ENV_ACTIVATIONS = "MEGAMOE_VLLM_ACTIVATIONS"
_ENV_CPU_BF16 = "MEGAMOE_VLLM_CPU_BF16"

_lock = threading.Lock()
_registered = None  # None before register ran; then the list of method kinds served ([] when off)
_banner = None  # register's line, until it reached a configured log (vLLM configures its logging late)


class Settings:
    """The plugin's settings, read from the environment: a bad value is an error naming the variable."""

    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        self.enabled = _flag(env, _ENV_SWITCH, True)
        self.activations = env.get(_ENV_ACTIVATIONS, "bf16")
        if self.activations not in ("bf16", "nvfp4"):
            raise ValueError(f"{_ENV_ACTIVATIONS}={self.activations!r}: expected 'bf16' (W4A16, the default) or 'nvfp4'")
        self.cpu_bf16 = _flag(env, _ENV_CPU_BF16, False)


def _flag(env, name, default):
    value = env.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


def logger():
    """vLLM's logger for this plugin: a child of the `vllm` logger, so its lines have vLLM's format and
    follow VLLM_LOGGING_LEVEL."""
    from vllm.logger import init_logger
    return init_logger("vllm.megamoe")


def announce():
    """Logs register's line where it did not reach vLLM's log yet: vLLM loads plugins before it
    configures its logging, so register's own line is lost in some processes; the first MoE layer
    megamoe decides on calls this."""
    global _banner
    with _lock:
        line, _banner = _banner, None
    if line is not None:
        logger().info("%s", line)


def register():
    """vLLM's general-plugin hook. Idempotent: the first call in a process installs megamoe's MoE
    methods and logs one line; later calls do nothing. Returns the MoE method kinds served."""
    global _registered, _banner
    with _lock:
        if _registered is not None:
            return list(_registered)
        settings = Settings()
        import megamoe
        log = logger()
        if not settings.enabled:
            _registered = []
            # A warning: it reaches the log even before vLLM configured it (Python's last-resort handler),
            # and no layer of megamoe's will repeat it later.
            log.warning("megamoe %s: off (%s=0): vLLM's own MoE methods run", megamoe.__version__, _ENV_SWITCH)
            return []
        from . import _methods
        _registered = _methods.install(settings)
        line = (f"megamoe {megamoe.__version__}: serving vLLM's {', '.join(_registered)} MoE methods where "
                f"megamoe runs on the layer's device (NVFP4 activations {settings.activations}; "
                f"{_ENV_SWITCH}=0 turns it off)")
        log.info("%s", line)
        if not log.hasHandlers() or not log.isEnabledFor(logging.INFO):
            _banner = line
        return list(_registered)
