from prefill_service.main import main

main()
