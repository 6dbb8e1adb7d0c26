"""otbrl.models"""
