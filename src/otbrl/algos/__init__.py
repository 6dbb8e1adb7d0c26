"""otbrl.algos"""
