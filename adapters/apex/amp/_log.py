"""Logging for the adapter: logger ``adapters.apex``, rate-limited, honouring ``verbosity``.

Apex printed "Gradient overflow. Skipping step ..." on every overflow. Here each kind of
message (per loss scaler) is logged on its 1st, 2nd, 4th, 8th ... occurrence, with the
running count, so a long run writes a logarithmic number of lines. ``verbosity=0``
silences the informational messages (warnings stay), ``verbosity>=2`` logs every one.
"""

from __future__ import annotations

import logging
from collections import Counter

#: The adapter's logger.
LOGGER = logging.getLogger("adapters.apex")


class RateLimitedLog:
    """Counts occurrences of message keys and logs the power-of-two ones.

    Args:
        verbosity: 0 (warnings only), 1 (rate-limited info), 2+ (every message).

    Example:
        >>> log = RateLimitedLog(verbosity=1)
        >>> [log.should_log("overflow0") for _ in range(5)]
        [True, True, False, True, False]
    """

    def __init__(self, verbosity: int = 1) -> None:
        self.verbosity = int(verbosity)
        self.counts: Counter[str] = Counter()

    def should_log(self, key: str) -> bool:
        """Count one occurrence of ``key``; True when it is to be logged."""
        self.counts[key] += 1
        n = self.counts[key]
        return self.verbosity >= 2 or (n & (n - 1)) == 0

    def info(self, key: str, msg: str) -> None:
        """Log ``msg`` at INFO (rate-limited; nothing at verbosity 0)."""
        if self.verbosity <= 0:
            self.counts[key] += 1
            return
        if self.should_log(key):
            LOGGER.info("%s (occurrence %d)", msg, self.counts[key])

    def warning(self, key: str, msg: str) -> None:
        """Log ``msg`` at WARNING (rate-limited, whatever the verbosity)."""
        if self.should_log(key):
            LOGGER.warning("%s (occurrence %d)", msg, self.counts[key])

    def always(self, msg: str) -> None:
        """Log ``msg`` at INFO unless verbosity is 0 (not rate-limited)."""
        if self.verbosity > 0:
            LOGGER.info("%s", msg)
