"""The process infrastructure every floor may use: locks, the rank watch, exit codes, CLI argument helpers, the build
cache. It imports only the standard library and the package's floor-1 modules (docs/architecture.md)."""
