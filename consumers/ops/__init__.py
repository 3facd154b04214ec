"""Operations: settings (environment + config file), the composition of a pod from them, the HTTP
server (health, readiness, metrics), structured logs, progress output.

May import: ``consumers.lanes``, ``consumers.runtime``, ``events``, ``drivers``. Never ``consumers.tools``.
"""
