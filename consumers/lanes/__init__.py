"""The pure lane rules: decide and complete, their commands and vocabulary (upstream's constants).

No I/O and no clock: everything here is a function of its arguments, which is what makes replay and
the rule tests cheap. May import: ``events``, ``drivers.contract``/``drivers.naming`` (names and
types only). Never ``consumers.runtime``, ``consumers.ops`` or ``consumers.tools``.
"""
