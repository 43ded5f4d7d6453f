use te_macros::Module;

#[derive(Module)]
#[module(skip)]
struct Model {
    hidden: usize,
}

fn main() {}
