"""`python -m baton.decode_service`."""
from baton.decode_service.main import main

main()
