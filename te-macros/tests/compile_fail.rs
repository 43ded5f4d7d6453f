//! `#[derive(Module)]` misuses fail to compile with an error spanning the misuse.

#[test]
fn misuses_are_compile_errors() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
