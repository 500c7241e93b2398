"""prefill_service"""
