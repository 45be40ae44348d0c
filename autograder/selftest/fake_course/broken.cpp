// A student file that does not compile: the grader must report this error and grade the rest.
int main() { return undeclared_identifier + ; }
