"""Every error and warning the package raises of its own, in one place (pure Python: the core and the integrations
import it; users catch them from the top level, `from unsloth_adaptive_kl import NonFiniteLogProbError`), and
`reject`, the usual wording of a bad setting's ValueError."""


def reject(name: str, value: object, allowed: str) -> ValueError:
    """The ValueError for a bad setting, in the package's usual wording: the field, its value and what is allowed
    (the integrations use it for their trainers' fields too; a combination of fields is worded by its own check)."""
    return ValueError(f"{name}={value!r} is invalid: allowed is {allowed}.")


class NonFiniteLogProbError(FloatingPointError, ValueError):
    """A NaN or infinite log-prob (policy, reference, or the old policy's where a door holds them) on a valid (mask=1)
    token: raised naming the step, the tensor and how many tokens, before the loss reaches the optimizer (masked
    positions may hold anything)."""


class KLEstimatorWarning(UserWarning):
    """An estimator that misses the regularised optimum where it is placed: 'k1' in the loss (it does not regularise),
    an estimator whose value is not the log-ratio in the reward (k2, k3, low_var_kl, k3+, k3_bottom_percentile; the
    KL lab's exact figures: docs, Ground truth)."""


class IncompatibleVersionError(RuntimeError):
    """An anchor an integration relies on is missing from the installed upstream source (names the anchor, the found
    version and the tested range)."""


class IncompatibleVersionWarning(UserWarning):
    """At `import unsloth_adaptive_kl`: an installed trainer library cannot be patched (the `IncompatibleVersionError`
    it raised, quoted). Its integrations are off; the core, and the integrations that do not use that library, work."""


class UntestedVersionWarning(UserWarning):
    """The installed version is outside the tested range, but every anchor holds, so the patch applies."""
