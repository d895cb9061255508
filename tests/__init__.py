"""The project's test suite (a regular package, so that `tests.*` imports cannot pick up a `tests`
package that a dependency installs into site-packages, as openrlhf 0.11.2 does)."""
