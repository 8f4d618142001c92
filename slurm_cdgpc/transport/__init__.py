"""Everything that crosses a process or machine boundary: request authentication, HTTP, SSH.

`auth` is the only module in the project that signs and checks MUNGE credentials (it runs the
``munge`` and ``unmunge`` programs; `credentials.munge_works` runs them once to see whether
munged answers) and the only one that reads the shared HMAC key. Nothing is imported here, so
that the Prolog and Epilog pay only for the modules they use.
"""

from __future__ import annotations
