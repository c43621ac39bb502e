"""``llamapack plan``: predict decode and prefill speed before loading a model, and choose the budgets.

``model`` is the pure speed model, ``hits`` the routing-model replay through the cache policy, ``probe`` the
machine's figures (I/O, cached per machine), ``recommend`` the budgets and alternatives, ``command`` the CLI.
"""
