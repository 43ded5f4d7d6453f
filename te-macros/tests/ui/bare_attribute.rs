use te_macros::Module;

#[derive(Module)]
struct Model {
    #[module]
    hidden: usize,
}

fn main() {}
