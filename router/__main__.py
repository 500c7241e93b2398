"""`python -m baton.router`."""
from baton.router.main import main

main()
