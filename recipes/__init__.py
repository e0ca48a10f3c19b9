"""Recipes: commands that chain the library, the precompute jobs and the benchmarks into one resumable run
(recipes/release.py builds and ships a default model). Nothing in prism/ or precompute/ imports or runs them."""
