"""`python -m baton.prefill_service`."""
from baton.prefill_service.main import main

main()
