"""otbrl.ops"""
