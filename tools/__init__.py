"""Tools for maintainers: tools/screenshots.py makes the README's pictures from the running app."""
