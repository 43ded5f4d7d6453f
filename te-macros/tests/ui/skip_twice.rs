use te_macros::Module;

#[derive(Module)]
struct Model {
    #[module(skip, skip)]
    hidden: usize,
}

fn main() {}
