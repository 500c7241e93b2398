"""decode_service"""
