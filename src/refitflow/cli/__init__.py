"""The ``refitflow`` command: its entry point (``main``), the registry and keys sub-commands
(``registry_cmd``), the demo (``demo``, its roles and display) and the synthetic models the demo
and the benchmarks use (``synthetic``). The only part of refitflow that reads the environment;
it may import every other part, and none imports it.
"""
