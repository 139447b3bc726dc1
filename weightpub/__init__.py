"""weightpub, the application: command line, YAML deployments, relay, status, demos.

Sits on top of ``publisher`` (trainer side) and ``subscriber_ext`` (inference
side), which sit on ``weightpub_wire``; nothing below imports from here.
"""

__version__ = "0.2.0"
